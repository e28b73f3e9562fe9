"""The local backend (`pdserve local`): a pool as processes on this machine, its scaling
rounds and a local Prometheus."""
