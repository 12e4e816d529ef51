"""Identity and access: who is calling (``identities``) and may they do it (``policies``).

Why a layer of its own: the admission sequence talks to these only through the ports in
``bettercompute.core.ports``, so Cedar and the token scheme can be swapped without touching
the service. This package must never import ``store`` or ``service``; it may use the standard
library, ``cedarpy`` and ``bettercompute.core``.
"""
