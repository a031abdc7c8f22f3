"""ClientApp: the node's partition (``--node-config partition-id=N``) trains with pyfedkern's local update."""

from pyfedkern.integrations.flower import make_client_app

app = make_client_app()  # reads the ExperimentConfig from the run config
