"""Fault-injection scenarios: the CPU demo pipeline under load, one fault each.

Each module starts its own leader (``conftest.leader``) and drives it with
:mod:`omni_actors.system.faultlab`.
"""
