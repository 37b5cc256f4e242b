"""The control plane: the wire codec (``wire``), two planes that carry it, chosen by ``plane`` (``tcp_plane``:
sealed frames over TCP, its loop on the driver's thread, with ``tcp_gate`` and ``tcp_frames``; ``channel``:
ZeroMQ), what both share (``plane_base``), ``faulty`` wrapping either for chaos, peer liveness (``liveness``), the bootstrap server and
client (``bootstrap``: its API and rules; ``bootstrap_schema``, ``bootstrap_server``,
``bootstrap_client``, ``request_signing``, ``deadline_io``), the deployment secret (``auth``) and the
metrics collectors (``metrics``). Below the peers; no peer logic here (look-ups of other deployments
are the engines': ``pdcore.protocol.lookups``)."""
