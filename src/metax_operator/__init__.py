"""metax-operator: the Python side of the MetaX GPU operator chart.

One package serves the post-renderer, the Helm hook Jobs and the runner, so that
each rule (merge, validation, rollout decision) has exactly one implementation.
"""
