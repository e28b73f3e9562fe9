module pdserve.local/cluster/pause

go 1.26.0
