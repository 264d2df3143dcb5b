"""Supervised child processes: how the app and the CLI start runs, checks and probes in children with
limits, bounded logs, and a verdict the child cannot forge."""
