"""What operates the server: settings, metrics, statistics, tracing, tenants, security, health probes."""
