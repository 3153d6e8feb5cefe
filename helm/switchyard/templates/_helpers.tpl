{{/* Names, labels and the small languages the templates share: TOML, the KV arithmetic, the
scaling queries. */}}

{{- define "switchyard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "switchyard.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "switchyard.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "switchyard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: switchyard
{{- end -}}

{{/* Selector labels of one component: (dict "root" $ "component" "server"). */}}
{{- define "switchyard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "switchyard.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "switchyard.image" -}}
{{- if not .Values.image.repository -}}
{{- fail "image.repository is required: the registry path of the switchyard image" -}}
{{- end -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "switchyard.serverServiceAccount" -}}
{{- default (include "switchyard.fullname" .) .Values.server.serviceAccount.name -}}
{{- end -}}

{{- define "switchyard.vllmServiceAccount" -}}
{{- default (printf "%s-vllm" (include "switchyard.fullname" .)) .Values.vllm.serviceAccount.name -}}
{{- end -}}

{{/* The vLLM StatefulSet of a model: (dict "root" $ "model" $m). Its pods are <this>-<ordinal>,
which are also their node ids. */}}
{{- define "switchyard.vllmName" -}}
{{- printf "%s-vllm-%s" (include "switchyard.fullname" .root) .model.key | trunc 52 | trimSuffix "-" -}}
{{- end -}}

{{/* True ("true") when the model's engines run in this cluster. */}}
{{- define "switchyard.served" -}}
{{- if and .root.Values.vllm.enabled .model.serve -}}true{{- end -}}
{{- end -}}

{{/* The URL in-cluster agents dial. */}}
{{- define "switchyard.agentServer" -}}
{{- if .Values.nodeAgent.server -}}
{{- .Values.nodeAgent.server -}}
{{- else -}}
{{- printf "http://%s.%s.svc.cluster.local:%d" (include "switchyard.fullname" .) .Release.Namespace (int .Values.server.port) -}}
{{- end -}}
{{- end -}}

{{/* The S3 prefix of a model revision: (dict "root" $ "model" $m). */}}
{{- define "switchyard.modelUri" -}}
{{- if not .model.revision -}}
{{- fail (printf "models[%s].revision is required: the directory under %s/%s/ holding the weights" .model.key .root.Values.modelStore.uri .model.name) -}}
{{- end -}}
{{- printf "%s/%s/%s/" (trimSuffix "/" .root.Values.modelStore.uri) .model.name .model.revision -}}
{{- end -}}

{{/* ---------------------------------------------------------------------------------------
TOML. Helm reads every number as a float, so toToml would write `max_waiting = 256.0`, which
the server's u64 fields refuse; these write integral numbers as integers. Strings go through
toJson: JSON string escapes are valid TOML basic-string escapes.
--------------------------------------------------------------------------------------- */}}
{{- define "switchyard.toml.value" -}}
{{- if kindIs "string" . -}}
{{- toJson . -}}
{{- else if kindIs "bool" . -}}
{{- . -}}
{{- else if or (kindIs "float64" .) (kindIs "int" .) (kindIs "int64" .) -}}
{{- if eq (float64 .) (float64 (int64 .)) -}}{{ int64 . }}{{- else -}}{{ . }}{{- end -}}
{{- else if kindIs "slice" . -}}
[{{ range $i, $e := . }}{{ if $i }}, {{ end }}{{ include "switchyard.toml.value" $e }}{{ end }}]
{{- else -}}
{{- fail (printf "cannot write a %s as TOML" (kindOf .)) -}}
{{- end -}}
{{- end -}}

{{/* The scalar keys of a map, one `key = value` line each, sorted; nulls and tables skipped. */}}
{{- define "switchyard.toml.scalars" -}}
{{- range $k, $v := . }}
{{- if and (not (kindIs "map" $v)) (not (kindIs "invalid" $v)) }}
{{ $k }} = {{ include "switchyard.toml.value" $v }}
{{- end }}
{{- end }}
{{- end -}}

{{/* ---------------------------------------------------------------------------------------
The KV-cache arithmetic of docs/capacity.md for one model: (dict "model" $m). Returns JSON:
  kvBytesPerToken = 2 x layers x kvHeads x headDim x kvBytesPerValue
  kvGiB           = gpus x gpuMemoryGiB x gpuMemoryUtilization - weightsGiB - activationsGiB
  kvTokens        = kvGiB in bytes / kvBytesPerToken, rounded down to vLLM's 16-token blocks
  maxNumSeqs      = min(kvTokens / typicalContextTokens, maxNumSeqsCap)
and fails on a plan that cannot run: no room for the KV cache, a context longer than the
cache, or more streams than the engine would batch.
--------------------------------------------------------------------------------------- */}}
{{- define "switchyard.sizing" -}}
{{- $m := .model -}}
{{- $s := $m.sizing -}}
{{- $perToken := mul 2 (int64 $s.layers) (int64 $s.kvHeads) (int64 $s.headDim) (int64 $s.kvBytesPerValue) -}}
{{- $usable := mulf (float64 $s.gpus) (float64 $s.gpuMemoryGiB) (float64 $s.gpuMemoryUtilization) -}}
{{- $kvGiB := subf $usable (float64 $s.weightsGiB) (float64 $s.activationsGiB) -}}
{{- if le $kvGiB 0.0 -}}
{{- fail (printf "models[%s]: no room for a KV cache: %d GPU(s) x %v GiB x %v = %.1f GiB usable, weights %v GiB + activations %v GiB leave %.1f GiB" $m.key (int64 $s.gpus) $s.gpuMemoryGiB $s.gpuMemoryUtilization $usable $s.weightsGiB $s.activationsGiB $kvGiB) -}}
{{- end -}}
{{- $blocks := floor (divf (divf (mulf $kvGiB 1073741824.0) (float64 $perToken)) 16.0) | int64 -}}
{{- $kvTokens := mul $blocks 16 -}}
{{- $fit := div $kvTokens (int64 $s.typicalContextTokens) -}}
{{- $maxNumSeqs := min $fit (int64 $s.maxNumSeqsCap) -}}
{{- if gt (int64 $s.maxModelLen) $kvTokens -}}
{{- fail (printf "models[%s]: maxModelLen %d is longer than the whole KV cache (%d tokens): vLLM would refuse to start" $m.key (int64 $s.maxModelLen) $kvTokens) -}}
{{- end -}}
{{- if gt (int64 $s.typicalContextTokens) (int64 $s.maxModelLen) -}}
{{- fail (printf "models[%s]: typicalContextTokens %d is above maxModelLen %d" $m.key (int64 $s.typicalContextTokens) (int64 $s.maxModelLen)) -}}
{{- end -}}
{{- if gt (int64 $s.streams) $maxNumSeqs -}}
{{- fail (printf "models[%s]: streams %d exceed what the KV cache holds at %d-token contexts (%d tokens / %d = %d): lower streams or typicalContextTokens, or add GPUs" $m.key (int64 $s.streams) (int64 $s.typicalContextTokens) $kvTokens (int64 $s.typicalContextTokens) $fit) -}}
{{- end -}}
{{- $explain := printf "2 x %d layers x %d KV heads x %d x %d B = %d B/token; %d GPU x %v GiB x %v - %v GiB weights - %v GiB activations = %.1f GiB KV = %d tokens (%d blocks of 16); %d / %d-token contexts = %d sequences" (int64 $s.layers) (int64 $s.kvHeads) (int64 $s.headDim) (int64 $s.kvBytesPerValue) $perToken (int64 $s.gpus) $s.gpuMemoryGiB $s.gpuMemoryUtilization $s.weightsGiB $s.activationsGiB $kvGiB $kvTokens $blocks $kvTokens (int64 $s.typicalContextTokens) $fit -}}
{{- dict "kvBytesPerToken" $perToken "kvGiB" (printf "%.1f" $kvGiB) "kvTokens" $kvTokens "maxNumSeqs" $maxNumSeqs "maxModelLen" (int64 $s.maxModelLen) "gpuMemoryUtilization" (toString $s.gpuMemoryUtilization) "gpus" (int64 $s.gpus) "streams" (int64 $s.streams) "explain" $explain | toJson -}}
{{- end -}}

{{/* The flags the arithmetic sets, for the StatefulSet and for NOTES.txt: (dict "model" $m). */}}
{{- define "switchyard.vllmSizingFlags" -}}
{{- $z := include "switchyard.sizing" . | fromJson -}}
{{- printf "--tensor-parallel-size %d --max-model-len %d --max-num-seqs %d --gpu-memory-utilization %s" (int64 $z.gpus) (int64 $z.maxModelLen) (int64 $z.maxNumSeqs) $z.gpuMemoryUtilization -}}
{{- end -}}

{{/* ---------------------------------------------------------------------------------------
Scaling signals of a model: (dict "root" $ "model" $m). Each term is `or vector(0)` so that a
model with no engine running (no vLLM series) still yields a number. A model that scales from
zero also counts the gateway's no_healthy_node refusals of the last 5 minutes, at most one
request's worth: this build refuses at once while a model has no node, so its queue stays
empty and only the refusals show that someone is asking.
--------------------------------------------------------------------------------------- */}}
{{- define "switchyard.query.demand" -}}
{{- $ns := .root.Release.Namespace -}}
{{- $n := .model.name -}}
(sum(vllm:num_requests_running{namespace="{{ $ns }}",model_name="{{ $n }}"}) or vector(0))
+ (sum(vllm:num_requests_waiting{namespace="{{ $ns }}",model_name="{{ $n }}"}) or vector(0))
+ (sum(switchyard_queue_depth{namespace="{{ $ns }}",model="{{ $n }}"}) or vector(0))
{{- if eq (int .model.autoscaling.minReplicas) 0 }}
+ (clamp_max(sum(increase(switchyard_requests_total{namespace="{{ $ns }}",model="{{ $n }}",code="no_healthy_node"}[5m])), 1) or vector(0))
{{- end -}}
{{- end -}}

{{- define "switchyard.query.kv" -}}
avg(vllm:kv_cache_usage_perc{namespace="{{ .root.Release.Namespace }}",model_name="{{ .model.name }}"}) or vector(0)
{{- end -}}

{{/* ---------------------------------------------------------------------------------------
The models with every optional field filled in, as a JSON list (fromJsonArray it). A values
file's `models` replaces the default list whole, so an entry may leave these out. sprig's
merge functions drop false and 0 (serve: false, minReplicas: 0), hence one field at a time.
--------------------------------------------------------------------------------------- */}}
{{- define "switchyard.models" -}}
{{- $out := list -}}
{{- $keys := dict -}}
{{- range $i, $m := .Values.models -}}
{{- if hasKey $keys $m.key -}}
{{- fail (printf "models: key %q is used twice" $m.key) -}}
{{- end -}}
{{- $_ := set $keys $m.key true -}}
{{- $s := deepCopy $m.sizing -}}
{{- if not (hasKey $s "maxNumSeqsCap") }}{{ $_ := set $s "maxNumSeqsCap" 256 }}{{ end -}}
{{- $t := default dict $m.tokenizer -}}
{{- $a := default dict $m.autoscaling -}}
{{- $al := default dict $m.alerts -}}
{{- $min := ternary $a.minReplicas 1 (hasKey $a "minReplicas") -}}
{{- $target := max 1 (div (mul (int64 $s.streams) 3) 4) -}}
{{- $auto := dict
      "enabled" (ternary $a.enabled true (hasKey $a "enabled"))
      "minReplicas" $min
      "maxReplicas" (ternary $a.maxReplicas (max 1 (int64 $min)) (hasKey $a "maxReplicas"))
      "targetStreamsPerReplica" (ternary $a.targetStreamsPerReplica $target (hasKey $a "targetStreamsPerReplica"))
      "kvCacheUsageTarget" (ternary $a.kvCacheUsageTarget 0.8 (hasKey $a "kvCacheUsageTarget"))
      "cooldownSeconds" (ternary $a.cooldownSeconds 300 (hasKey $a "cooldownSeconds"))
      "warmSchedule" $a.warmSchedule -}}
{{- $n := dict
      "key" $m.key
      "name" $m.name
      "revision" (default "" $m.revision)
      "serve" (ternary $m.serve true (hasKey $m "serve"))
      "gateway" $m.gateway
      "tokenizer" (dict "file" (default "tokenizer.json" $t.file) "chatTemplate" (default "" $t.chatTemplate))
      "sizing" $s
      "pools" (default (list "gpu-l40s") $m.pools)
      "tolerations" (default list $m.tolerations)
      "resources" $m.resources
      "extraArgs" (default list $m.extraArgs)
      "startupTimeoutSeconds" (default 1800 $m.startupTimeoutSeconds)
      "autoscaling" $auto
      "alerts" (dict "ttftP95Seconds" (dig "alerts" "ttftP95Seconds" 3 $m) "ledgerDriftRatio" (ternary $al.ledgerDriftRatio 0.01 (hasKey $al "ledgerDriftRatio"))) -}}
{{- if and $.Values.vllm.enabled $n.serve (not $n.resources) -}}
{{- fail (printf "models[%s].resources is required: the CPU and memory requests of its vLLM pods" $m.key) -}}
{{- end -}}
{{- $out = append $out $n -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}
