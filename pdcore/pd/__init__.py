"""The PD peers: the scheduler's side of each role, sans-IO (``front``: ``PrefillFront``,
``DecodeFront``, which the simulator drives too), what prefill and decode ranks share on the planes
(``peer``: ``TransferPeer``), ``PrefillPeer`` with its outbox (``prefill``), ``DecodePeer`` with its
inbox (``decode``) and their configuration (``config``: ``TransferConfig``, ``PrefillConfig``,
``DecodeConfig``). The per-request protocol is the engines' (``pdcore.protocol``)."""
