// Command coredns is CoreDNS with only the plugins the dev cluster's node uses: it
// answers for Services and Pods from the API server (kubernetes) and nothing else, so
// the build leaves out the cloud providers' plugins of the full distribution.
package main

import (
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/ready"
)

func main() {
	coremain.Run()
}
