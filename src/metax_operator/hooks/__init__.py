"""The Helm hook entry points (one module each) and what they share (`common`)."""
