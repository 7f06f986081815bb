"""Running jobs on machines: ``launch`` (slurm / torchrun scripts with the NIC environment of a
platform) and ``local`` (rank processes on this host, several per GPU if asked)."""
