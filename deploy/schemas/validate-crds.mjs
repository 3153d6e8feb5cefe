// Validates custom resources with the compiled validators of the npm packages pinned in
// package.json: patterns, formats, enums and required fields, as the CRDs' OpenAPI schemas
// state them (consolidateAfter: "10 minutes" is refused here, for example). Unknown fields are
// caught by the JSON schemas in ./crds, which scripts/check-deploy applies separately.
//
// scripts/check-deploy copies this file next to the installed node_modules
// (target/deploy-node) and pipes one JSON object per line:
//   {"source": "<where it came from>", "object": {...}}
// It prints one line per object ("ok" or the errors) and exits 1 if any object failed or
// is of a kind it has no validator for.
import { createInterface } from "node:readline";

const MODELS = {
  "keda.sh/v1alpha1/ScaledObject": ["@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject", "ScaledObject"],
  "karpenter.sh/v1/NodePool": ["@kubernetes-models/karpenter/karpenter.sh/v1/NodePool", "NodePool"],
  "karpenter.k8s.aws/v1/EC2NodeClass": ["@kubernetes-models/karpenter/karpenter.k8s.aws/v1/EC2NodeClass", "EC2NodeClass"],
  "monitoring.coreos.com/v1/ServiceMonitor": ["@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor", "ServiceMonitor"],
  "monitoring.coreos.com/v1/PodMonitor": ["@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PodMonitor", "PodMonitor"],
  "monitoring.coreos.com/v1/PrometheusRule": ["@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PrometheusRule", "PrometheusRule"],
};

const classes = new Map();
async function modelFor(apiVersion, kind) {
  const key = `${apiVersion}/${kind}`;
  if (!(key in MODELS)) return null;
  if (!classes.has(key)) {
    const [specifier, name] = MODELS[key];
    classes.set(key, (await import(specifier))[name]);
  }
  return classes.get(key);
}

let failed = 0;
const lines = createInterface({ input: process.stdin, crlfDelay: Infinity });
for await (const line of lines) {
  if (!line.trim()) continue;
  const { source, object } = JSON.parse(line);
  const where = `${source}: ${object.kind}/${object.metadata?.name ?? "?"}`;
  const Model = await modelFor(object.apiVersion, object.kind);
  if (!Model) {
    console.log(`FAIL ${where}: no validator for ${object.apiVersion} ${object.kind}`);
    failed++;
    continue;
  }
  try {
    new Model(object).validate();
    console.log(`ok   ${where}`);
  } catch (e) {
    console.log(`FAIL ${where}: ${e.message}`);
    failed++;
  }
}
process.exit(failed ? 1 : 0);
