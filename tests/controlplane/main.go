// Command controlplane is one binary holding the real Kubernetes control plane, built from
// Kubernetes' own Go modules: kube-apiserver, kube-controller-manager, kube-scheduler, kubectl
// and an embedded etcd, chosen by the first argument (as hyperkube once did). One link instead
// of five keeps the build short; it must never carry code of ours beyond choosing the command.
package main

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/spf13/cobra"
	"k8s.io/component-base/cli"
	kubectlcmd "k8s.io/kubectl/pkg/cmd"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
)

func main() {
	name := filepath.Base(os.Args[0])
	args := os.Args[1:]
	if name == "controlplane" {
		if len(args) == 0 {
			fmt.Fprintln(os.Stderr, "usage: controlplane etcd|kube-apiserver|kube-controller-manager|kube-scheduler|kubectl [flags]")
			os.Exit(2)
		}
		name, args = args[0], args[1:]
	}
	var command *cobra.Command
	switch name {
	case "etcd":
		os.Exit(runEtcd(args))
	case "kube-apiserver":
		command = apiserver.NewAPIServerCommand()
	case "kube-controller-manager":
		command = controllermanager.NewControllerManagerCommand()
	case "kube-scheduler":
		command = scheduler.NewSchedulerCommand()
	case "kubectl":
		command = kubectlcmd.NewDefaultKubectlCommand()
	default:
		fmt.Fprintf(os.Stderr, "controlplane: unknown command %q\n", name)
		os.Exit(2)
	}
	command.SetArgs(args)
	os.Exit(cli.Run(command))
}
