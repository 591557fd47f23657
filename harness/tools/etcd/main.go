// Command etcd is etcd's own server main, built from the pinned module version: Debian
// ships 3.4, older than what current kube-apiservers are tested with.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
