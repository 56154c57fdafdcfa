"""Operations: Prometheus metrics, the diagnose runbook, the dashboard's data."""
