// Command etcd is the etcd server at the version k8s.io/kubernetes v1.34.4 requires.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
