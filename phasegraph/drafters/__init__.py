"""Drafting methods built on the public framework (a phase, a graph, a registration), each
registered by name when its module is imported (``phasegraph.runtime.methods``)."""
