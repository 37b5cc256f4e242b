"""What every role's rank runs on: its configuration (``config``: ``NodeConfig``) and its peer
(``base``: ``PeerBase``: the driver and I/O threads, the transport, the control channel, the
registration with a bootstrap server). Below the PD peers (``pdcore.pd``) and EPD (``pdcore.epd``);
no role's protocol here."""
