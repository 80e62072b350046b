"""KV cache: wire format, transports, pools."""
