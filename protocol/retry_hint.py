"""The retry hint a gRPC refusal may carry, shared by the server that sets it and the clients that honour it."""

RETRY_AFTER_METADATA = "retry-after"
"""Trailing metadata key: whole seconds before a request refused RESOURCE_EXHAUSTED may succeed (a tenant's
limit), as HTTP's Retry-After header on the same refusal."""
