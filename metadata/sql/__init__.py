"""The SQL engine, one mixin per concern (namespace, chunk references, leases,
checkpoints and their queries, retention, maintenance, the change log, requests applied
once, the dump) composed in base.SqlEngine; the engines (metadata/engines/) supply the
dialect."""
