"""The NIXL KV connector: prefill workers push KV blocks into blocks a decode node reserved."""
