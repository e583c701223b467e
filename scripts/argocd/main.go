// The two Argo CD components the GitOps tests run, in one binary: argo-cd's own commands,
// chosen as argo-cd's multi-call binary chooses them (ARGOCD_BINARY_NAME, else the name the
// binary was called by). Argo CD's API server, UI, CLI, Dex, ApplicationSet and notification
// controllers are left out: the tests drive Application objects with kubectl, and the
// build takes about half the time of argo-cd's full cmd.
package main

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/spf13/cobra"
	"k8s.io/klog/v2"

	appcontroller "github.com/argoproj/argo-cd/v3/cmd/argocd-application-controller/commands"
	reposerver "github.com/argoproj/argo-cd/v3/cmd/argocd-repo-server/commands"
	"github.com/argoproj/argo-cd/v3/util/log"
)

func init() {
	// As argo-cd's cmd/main.go: klog logs through Argo CD's configured logger.
	klog.SetLogger(log.NewLogrusLogger(log.NewWithCurrentConfig()))
}

func main() {
	name := filepath.Base(os.Args[0])
	if env := os.Getenv("ARGOCD_BINARY_NAME"); env != "" {
		name = env
	}
	var command *cobra.Command
	switch name {
	case "argocd-application-controller":
		command = appcontroller.NewCommand()
	case "argocd-repo-server":
		command = reposerver.NewCommand()
	default:
		fmt.Fprintf(os.Stderr, "error: %s is not argocd-application-controller or argocd-repo-server: "+
			"set ARGOCD_BINARY_NAME to one of them\n", name)
		os.Exit(2)
	}
	if err := command.Execute(); err != nil {
		os.Exit(1)
	}
}
