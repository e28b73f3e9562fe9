// Command pause is the node's pod sandbox process: it holds the pod's namespaces and
// does nothing else until told to stop (no registry serves registry.k8s.io/pause here).
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	<-stop
}
