"""Generated gRPC stubs of proto/tandem.proto (regenerate with scripts/gen_proto.sh); imported as `tandem_proto`."""
