"""Models as the phases see them: the target adapter, the draft kinds, loading, attention backend.

Import the submodules directly (``phasegraph.runtime.models.target`` and so on); this package
imports nothing eagerly, so that ``import phasegraph.runtime`` stays cheap.
"""
