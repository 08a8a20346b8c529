"""Benchmarks behind ``vismemo bench ...``; each writes NAME.md and NAME.json to an output folder."""
