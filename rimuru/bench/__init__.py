"""Workloads (ShareGPT, Poisson arrivals) and the serving benchmark client."""
