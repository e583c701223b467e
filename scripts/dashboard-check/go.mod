// The dashboard checker of tests/chart/test_dashboard.py (built by scripts/setup.d/10-dashboard-check).
module metax-operator.local/dashboard-check

go 1.21

require github.com/grafana/grafana-foundation-sdk/go v0.0.22
