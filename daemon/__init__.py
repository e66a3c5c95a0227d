"""edgekitd: the on-device report daemon (REST on a Unix socket, systemd notify/watchdog/socket activation,
durable SQLite jobs, DICOM SR output). Entry point: `edgekit.daemon.main:main`."""
