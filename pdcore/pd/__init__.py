"""The PD peers: what prefill and decode ranks share (``_peer``), ``PrefillPeer`` (``prefill``, with the
announcements parked before their room registers: ``parking``), ``DecodePeer`` (``decode``) and their
configuration (``config``)."""
