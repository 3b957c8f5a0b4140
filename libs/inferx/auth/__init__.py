"""Who may do what: API tokens, roles and tenants (issue #17).

`model` is pure (token format, hashing, roles, which method needs which role);
`store` keeps tenants and tokens in etcd; the router's `AuthGate` checks every call.
"""
