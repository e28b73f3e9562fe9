"""pdserve control plane: the ServingPool API, rendering, the kopf operator."""
