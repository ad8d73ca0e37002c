"""The latency SLO serving is judged by in these benchmarks: a request rate is sustained when the TTFT p99 and the
TPOT p99 of its point stay within these (the regime map's SLO capacity, the serving targets, serve_sweep's
`elastic-slo` configuration). No imports: the sweep's own process stays light."""

TTFT_P99_SLO_MS = 2000.0
TPOT_P99_SLO_MS = 50.0
