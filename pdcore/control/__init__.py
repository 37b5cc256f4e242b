"""The control plane: the wire codec (``wire``), the ZeroMQ control channel (``channel``; ``plane``
chooses it, ``faulty`` wraps it for chaos), peer liveness (``liveness``), the bootstrap server and
client (``bootstrap``: its API and rules; ``bootstrap_schema``, ``bootstrap_server``,
``bootstrap_client``, ``request_signing``, ``deadline_io``), the deployment secret (``auth``) and the
metrics collectors (``metrics``). Below the peers; no peer logic here (look-ups of other deployments
are the engines': ``pdcore.protocol.lookups``)."""
