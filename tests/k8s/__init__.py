"""Tests of nodeagent/k8s/ and deploy/: the device plugin, manifests and chart."""
