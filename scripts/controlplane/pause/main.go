// Command pause is the sandbox ("pause") container of the real node's pods: it holds the pod's
// namespaces and exits on SIGTERM or SIGINT, as registry.k8s.io/pause does (no registry is
// reachable here, so the node's image is built from this).
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	<-stop
}
