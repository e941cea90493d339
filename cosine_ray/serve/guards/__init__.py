"""Guards of the HTTP layer: API keys and tenants, fair admission, field bounds, the proxy middleware."""
