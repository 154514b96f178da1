"""The signed binary cache (the `cache` extra: fsspec, s3fs, cryptography): stores on a folder or a bucket
(`store`), ed25519 signatures and trusted keys (`signing`), and what is pushed, substituted and pulled by ref
(`binary_cache`). Builds and fleets import it; the runtime a service loads never does (import-linter)."""
