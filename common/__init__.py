"""Types shared by every stoker process: sampling parameters, engine config, IPC messages."""
