"""The argument groups the subcommands share, one module per concern: detection (the hang
detector, stragglers, health probes), snapshot (snapshots and the durable tier), nodes (the nodes
of a job), security (TLS), logs (worker output, ``--log-level``) and metrics (``--metrics-port``).
Each adds its flags to a parser and reads them back from the parsed namespace."""
