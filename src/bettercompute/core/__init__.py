"""The pure domain: requests and their validation, errors, ids, durations, attributes, states,
placement.

Nothing here does I/O, reads a clock or imports another layer of this package; every function
is a value in, value out computation, so it can be tested without a database.
"""
