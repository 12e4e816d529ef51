"""The use cases every door calls: create, get, list, release, cancel, extend, renew, node
reports, and the reconciler and event loops.

This layer wires ``core`` (rules), ``iam`` (decisions) and ``store`` (transactions) in the order
the guide prescribes. It never speaks SQL and never knows which door called it.
"""
