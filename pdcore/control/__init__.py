"""The control plane: the wire codec (``wire``), the ZeroMQ control channel (``channel``), the bootstrap
server and client (``bootstrap``), the deployment secret (``auth``), lookups of other deployments
(``lookup``) and the metrics collectors (``metrics``). Below the peers; no peer logic here."""
