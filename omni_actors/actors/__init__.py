"""The actors: coordinator, stage pools, engines (replicas), requests, node agents.

Importing this package fixes a Thespian race first (:mod:`.thespian_fixes`): every
process that runs or starts these actors imports it before its actor system starts.
"""

from omni_actors.actors import thespian_fixes

thespian_fixes.apply()
