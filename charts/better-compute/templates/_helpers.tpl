{{/*
Names, labels and small values every template shares. Nothing here renders an object.
*/}}

{{- define "bcd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's prefix for every object name (cluster-scoped ones included). */}}
{{- define "bcd.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "bcd.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "bcd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: better-compute
{{- end }}

{{/* Selector labels of one component: include "bcd.selectorLabels" (list . "operator") */}}
{{- define "bcd.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "bcd.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "bcd.componentLabels" -}}
{{ include "bcd.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* repository:tag, or repository@digest when a digest is given. */}}
{{- define "bcd.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{- /* The node agent's image: the Dockerfile's node-agent target, without the server's
dependencies; image.nodeRepository, else <image.repository>-node, at the same tag. */ -}}
{{- define "bcd.nodeImage" -}}
{{- $repository := .Values.image.nodeRepository | default (printf "%s-node" .Values.image.repository) }}
{{- if .Values.image.nodeDigest }}
{{- printf "%s@%s" $repository .Values.image.nodeDigest }}
{{- else }}
{{- printf "%s:%s" $repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{- define "bcd.operatorName" -}}
{{- printf "%s-operator" (include "bcd.fullname" .) }}
{{- end }}

{{- /* The node-report CA's Secret: a provided one, else the named one, else <release>-node-ca. */ -}}
{{- define "bcd.nodeCASecret" -}}
{{- $ca := .Values.operator.nodeCA | default dict }}
{{- $ca.existingSecret | default $ca.secretName | default (printf "%s-node-ca" .Release.Name) }}
{{- end }}

{{- define "bcd.devicePluginName" -}}
{{- printf "%s-device-plugin" (include "bcd.fullname" .) }}
{{- end }}

{{/* The Service in front of the operator: HTTP API and webhooks. */}}
{{- define "bcd.serviceName" -}}
{{- include "bcd.fullname" . }}
{{- end }}

{{- /* "true" when the operator makes, keeps and renews the webhook certificate itself
(webhook.operatorManaged, and no cert-manager). */ -}}
{{- define "bcd.webhookByOperator" -}}
{{- if and .Values.webhook.operatorManaged (not .Values.webhook.certManager.enabled) }}true{{ end }}
{{- end }}

{{- define "bcd.webhookSecretName" -}}
{{- printf "%s-webhook-tls" (include "bcd.fullname" .) }}
{{- end }}

{{- define "bcd.policiesName" -}}
{{- printf "%s-policies" (include "bcd.fullname" .) }}
{{- end }}

{{/* The Secret holding DATABASE_URL and its key: the chart's own when database.url is set. */}}
{{- define "bcd.databaseSecretName" -}}
{{- if .Values.database.url }}
{{- printf "%s-database" (include "bcd.fullname" .) }}
{{- else }}
{{- default (printf "%s-database" (include "bcd.fullname" .)) .Values.database.existingSecret.name }}
{{- end }}
{{- end }}

{{- define "bcd.databaseSecretKey" -}}
{{- if .Values.database.url }}url{{ else }}{{ .Values.database.existingSecret.key }}{{ end }}
{{- end }}

{{/* Where the operator reads its Cedar policy files: BCD_POLICY_FILES, colon-separated. */}}
{{- define "bcd.policyFiles" -}}
{{- $paths := list }}
{{- range $name, $_ := .Values.policies.files }}
{{- $paths = append $paths (printf "/etc/bcd/policies/%s.cedar" $name) }}
{{- end }}
{{- join ":" $paths }}
{{- end }}

{{/* BCD_NODE_LABELS: k=v pairs, comma-separated, in key order. */}}
{{- define "bcd.nodeLabels" -}}
{{- $pairs := list }}
{{- range $key, $value := . }}
{{- $pairs = append $pairs (printf "%s=%s" $key $value) }}
{{- end }}
{{- join "," $pairs }}
{{- end }}

{{- /* "true" when the operator must not make the node CA: a provided Secret or cert-manager's. */ -}}
{{- define "bcd.nodeCAProvided" -}}
{{- if or .Values.operator.nodeCA.existingSecret .Values.nodeCertificates.certManager.enabled }}true{{ end }}
{{- end }}

{{/*
The pod webhooks' matchConditions (CEL): the pod carries the bcd.dev/reservation label, or a
container or init container asks a bcd.dev/ resource in its requests or limits. Written once
for both lists (no list-of-lists trick, so the API server's type checker accepts it as is).
*/}}
{{- define "bcd.podWebhookCondition" -}}
{{- $asks := "c, has(c.resources) && ((has(c.resources.limits) && c.resources.limits.exists(k, k.startsWith('bcd.dev/'))) || (has(c.resources.requests) && c.resources.requests.exists(k, k.startsWith('bcd.dev/'))))" -}}
(has(object.metadata.labels) && 'bcd.dev/reservation' in object.metadata.labels) || object.spec.containers.exists({{ $asks }}) || (has(object.spec.initContainers) && object.spec.initContainers.exists({{ $asks }}))
{{- end }}

{{/*
A component's extra list items (extraEnv, extraVolumes, extraVolumeMounts) after the chart's
own, as YAML: include "bcd.extraItems" (dict "own" <the chart's items as YAML> "extra" <list>
"key" "name" "value" "operator.extraEnv"). Fails, naming the value, when an item has the key
of one of the chart's items or of an earlier extra one: the API server keeps a list by that key,
and server-side apply refuses a duplicate.
*/}}
{{- define "bcd.extraItems" -}}
{{- $own := list }}
{{- range (.own | fromYamlArray) }}
{{- $own = append $own (get . $.key) }}
{{- end }}
{{- $seen := list }}
{{- range $i, $item := .extra }}
{{- $id := get $item $.key }}
{{- if has $id $own }}
{{- fail (printf "%s[%d]: %s %q is the chart's own; choose another" $.value $i $.key $id) }}
{{- end }}
{{- if has $id $seen }}
{{- fail (printf "%s[%d]: %s %q is given twice" $.value $i $.key $id) }}
{{- end }}
{{- $seen = append $seen $id }}
{{- end }}
{{- with .extra }}
{{- toYaml . }}
{{- end }}
{{- end }}

{{/*
Every extra volume mount names a volume of the pod: include "bcd.checkMounts" (dict "own"
<the chart's volumes as YAML> "extra" <extraVolumes> "mounts" <extraVolumeMounts> "value"
"operator.extraVolumeMounts").
*/}}
{{- define "bcd.checkMounts" -}}
{{- $names := list }}
{{- range (concat (.own | fromYamlArray) (.extra | default list)) }}
{{- $names = append $names .name }}
{{- end }}
{{- range $i, $mount := .mounts }}
{{- if not (has $mount.name $names) }}
{{- fail (printf "%s[%d]: no volume named %q in the pod (add it to the extraVolumes beside it)" $.value $i $mount.name) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
A component's topologySpreadConstraints, each without a labelSelector given the component's
pod labels: include "bcd.topologySpread" (list . "operator" <constraints>).
*/}}
{{- define "bcd.topologySpread" -}}
{{- $root := index . 0 }}
{{- $component := index . 1 }}
{{- $constraints := list }}
{{- range (index . 2) }}
{{- $constraint := deepCopy . }}
{{- if not (hasKey $constraint "labelSelector") }}
{{- $labels := include "bcd.selectorLabels" (list $root $component) | fromYaml }}
{{- $_ := set $constraint "labelSelector" (dict "matchLabels" $labels) }}
{{- end }}
{{- $constraints = append $constraints $constraint }}
{{- end }}
{{- toYaml $constraints }}
{{- end }}

{{/* The database as host and parts (database.host), instead of a URL. */}}
{{- define "bcd.databaseByParts" -}}
{{- if (.Values.database | default dict).host }}true{{ end }}
{{- end }}
