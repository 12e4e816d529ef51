"""Device-plugin tests: our kubelet protos, their generated modules, and real gRPC over sockets."""
