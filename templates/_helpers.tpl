{{/*
Helpers of the metax-operator chart, one idea each. Helpers that need a component take a dict:
`(dict "root" $ "key" "driver")`, where `key` is the component's values key.
*/}}

{{/* Fails unless ARGS, the argument of helper NAME, is a dict with every KEY: a template that
calls a helper wrongly fails at render time, naming the helper and the argument, instead of
rendering an empty field. Takes (list NAME ARGS KEY...). */}}
{{- define "metax-operator.needs" -}}
{{- $name := index . 0 -}}
{{- $args := index . 1 -}}
{{- $keys := slice . 2 -}}
{{- if not (kindIs "map" $args) }}{{ fail (printf "%s takes (dict %s)" $name (join " ... " $keys)) }}{{ end -}}
{{- range $keys -}}
  {{- if not (hasKey $args .) }}{{ fail (printf "%s: missing argument %q" $name .) }}{{ end -}}
{{- end -}}
{{- end }}

{{/* The chart name. */}}
{{- define "metax-operator.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end }}

{{/* Prefix of the release-wide objects (runner, RBAC): the chart name. The component
DaemonSets keep the seed's fixed names (metax-driver, ...). */}}
{{- define "metax-operator.fullname" -}}
{{- include "metax-operator.name" . -}}
{{- end }}

{{/* The `helm.sh/chart` label value. */}}
{{- define "metax-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end }}

{{/* Selector labels of a component (never change across upgrades: selectors are immutable). */}}
{{- define "metax-operator.selectorLabels" -}}
{{- include "metax-operator.needs" (list "selectorLabels" . "root" "key") -}}
app.kubernetes.io/name: {{ include "metax-operator.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .key }}
{{- with .pool }}
{{ include "metax-operator.poolLabel" . }}: {{ .name }}
{{- end }}
{{- end }}

{{/* Labels of a pod template: the selector labels plus those that do not change with the
chart version, so a chart upgrade alone does not roll the pods (for the driver it would
start a staged rollout). */}}
{{- define "metax-operator.podLabels" -}}
{{ include "metax-operator.selectorLabels" . }}
app.kubernetes.io/part-of: {{ include "metax-operator.partOf" .root }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Labels of every object: the standard set, `helm.sh/chart` and `commonLabels`. */}}
{{- define "metax-operator.labels" -}}
{{ include "metax-operator.podLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
helm.sh/chart: {{ include "metax-operator.chart" .root }}
{{- end }}

{{/* The metadata block every object shares: name, namespace (when namespaced), labels and
annotations (`commonAnnotations` plus the optional dict `annotations`).
Takes (dict "root" $ "key" COMPONENT "name" NAME ["clusterScoped" true] ["annotations" DICT]). */}}
{{- define "metax-operator.metadata" -}}
{{- include "metax-operator.needs" (list "metadata" . "root" "key" "name") -}}
name: {{ .name }}
{{- if not .clusterScoped }}
namespace: {{ .root.Release.Namespace }}
{{- end }}
labels:
  {{- include "metax-operator.labels" . | nindent 2 }}
{{- with merge (dict) (.annotations | default dict) .root.Values.commonAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The registry of an image: its own `registry`, else the global one.
Takes (dict "root" $ "registry" OWN_REGISTRY). */}}
{{- define "metax-operator.registry" -}}
{{- include "metax-operator.needs" (list "registry" . "root" "registry") -}}
{{- .registry | default .root.Values.registry -}}
{{- end }}

{{/* An image reference `<registry>/<name>:<tag>[@<digest>]`, the tag defaulting to the
appVersion; with a digest the runtime pulls by digest (the format of src/metax_operator/chart/images.py,
which the runner uses for the payloads; tests/chart/test_images.py checks they agree).
Takes (dict "root" $ "image" {registry, name, tag, digest}). */}}
{{- define "metax-operator.image" -}}
{{- include "metax-operator.needs" (list "image" . "root" "image") -}}
{{- printf "%s/%s:%s" (include "metax-operator.registry" (dict "root" .root "registry" .image.registry)) .image.name (.image.tag | default .root.Chart.AppVersion | toString) -}}
{{- with .image.digest }}@{{ . }}{{ end -}}
{{- end }}

{{/* A component's live DaemonSet as JSON (`fromJson` it), once the release has installed it and
the runner keeps it (`runner.enabled`); `{}` without a cluster (`helm template`, Argo CD), before
the install, and without the runner. Its shared fields (docs/runner.md: scheduling, the
environment variables set from CR fields, the payload images) are then rendered as it holds
them: the runner writes them from the CR, where the values arrive through the bootstrap hook,
and Helm writing the values' copy would, wherever the two differ (after a runtime edit of the CR,
the seed's `kubectl patch` of the version, a rollback), change the pods a second time (Helm 3) or
fail the upgrade on a field conflict (Helm 4). Takes (dict "root" $ "name" DAEMONSET). */}}
{{- define "metax-operator.liveDaemonSet" -}}
{{- $live := dict -}}
{{- if .root.Values.runner.enabled -}}
  {{- $live = lookup "apps/v1" "DaemonSet" .root.Release.Namespace .name | default dict -}}
{{- end -}}
{{- toJson $live -}}
{{- end }}

{{/* The scheduling fields of a component's pod template, as JSON: the live DaemonSet's
(metax-operator.liveDaemonSet; its annotation `shared-fields: live` tells the post-renderer to
leave them), else the chart's base, which the post-renderer merges the values into. Takes the
component's context with "live". */}}
{{- define "metax-operator.scheduling" -}}
{{- include "metax-operator.needs" (list "scheduling" . "root" "key" "live") -}}
{{- $pod := (((.live).spec).template).spec | default dict -}}
{{- $fields := dict -}}
{{- range $field := list "nodeSelector" "affinity" "tolerations" -}}
  {{- if hasKey $pod $field }}{{ $_ := set $fields $field (get $pod $field) }}{{ end -}}
{{- end -}}
{{- if $fields -}}
  {{- toJson $fields -}}
{{- else -}}
  {{- include "metax-operator.schedulingBase" . -}}
{{- end -}}
{{- end }}

{{/* The value of each plain environment variable of the live DaemonSet's containers, by name, as
JSON (`{}` when there is none). Takes the component's context with "live". */}}
{{- define "metax-operator.liveEnv" -}}
{{- $env := dict -}}
{{- range ((((.live).spec).template).spec).containers -}}
  {{- range .env -}}
    {{- if not .valueFrom }}{{ $_ := set $env .name (.value | default "") }}{{ end -}}
  {{- end -}}
{{- end -}}
{{- toJson $env -}}
{{- end }}

{{/* The image of the live DaemonSet's init container NAME, or DEFAULT when there is none.
Takes (dict "live" LIVE "name" NAME "default" IMAGE). */}}
{{- define "metax-operator.liveInitImage" -}}
{{- $image := .default -}}
{{- $name := .name -}}
{{- range ((((.live).spec).template).spec).initContainers -}}
  {{- if eq .name $name }}{{ $image = .image }}{{ end -}}
{{- end -}}
{{- $image -}}
{{- end }}

{{/* A ConfigMap admins edit in place (seed §3.2.6): its `data` as the values render it (`data`,
YAML), and once the release is installed the live ConfigMap's keys over it. The values reach the
live ConfigMap through the CR (the bootstrap hook, then the runner, which writes a key when its
CR field changed), so Helm writing the values' copy would, wherever the two differ, undo the
admin's edit (Helm 3's three-way merge) or fail the upgrade on a field conflict with `kubectl
edit` (Helm 4). A key the live ConfigMap lacks (a new chart's) comes from the values; without a
cluster (`helm template`, Argo CD) or before the install, all of them. Takes (dict "root" $
"name" NAME "data" YAML). */}}
{{- define "metax-operator.configMapData" -}}
{{- include "metax-operator.needs" (list "configMapData" . "root" "name" "data") -}}
{{- $data := fromYaml (printf "%s\n" .data) -}}
{{- with lookup "v1" "ConfigMap" .root.Release.Namespace .name -}}
  {{- $data = merge (dict) (.data | default dict) $data -}}
{{- end -}}
{{- toYaml $data -}}
{{- end }}

{{/* The values' driver payload (`driver.payload`: registry, name, version, digest) as an image
map for metax-operator.image, as JSON: its version is the tag. Takes $. */}}
{{- define "metax-operator.driverPayloadValuesImage" -}}
{{- $payload := .Values.driver.payload -}}
{{- dict "registry" $payload.registry "name" $payload.name "tag" $payload.version "digest" $payload.digest | toJson -}}
{{- end }}

{{/* The `updateStrategy` field of a component DaemonSet other than the driver's: rendered only
with `runner.enabled: false`. With the runner it alone writes it, so that no release's manifest
holds it and `helm rollback` cannot write it back while the pre-rollback hook has set `OnDelete`
(contract.COMPONENT_UPDATE_STRATEGY). Takes $. */}}
{{- define "metax-operator.componentUpdateStrategyField" -}}
{{- if not .Values.runner.enabled -}}
updateStrategy:
  {{- include "metax-operator.componentUpdateStrategy" . | fromJson | toYaml | nindent 2 }}
{{- end -}}
{{- end }}

{{/* The deprecated global `tolerations` as a JSON list. The value is a list, or a string from
`--set-file tolerations=FILE` holding either a YAML list or the seed's `{tolerations: [...]}`. */}}
{{- define "metax-operator.tolerationsList" -}}
{{- $value := .Values.tolerations | default list -}}
{{- if kindIs "string" $value -}}
  {{- $doc := fromYaml $value -}}
  {{- if hasKey $doc "tolerations" -}}
    {{- $value = $doc.tolerations | default list -}}
  {{- else if hasKey $doc "Error" -}}
    {{- $value = fromYamlArray $value -}}
  {{- else if $doc -}}
    {{- $value = list "not a list" -}}
  {{- else -}}
    {{- $value = list -}}
  {{- end -}}
{{- end -}}
{{- if not (kindIs "slice" $value) }}{{ $value = list "not a list" }}{{ end -}}
{{- range $value -}}
  {{- if not (kindIs "map" .) -}}
    {{- fail "tolerations: the value (or the file given with --set-file tolerations=FILE) must be a YAML list of tolerations or a mapping `tolerations: [...]`; better, move them to podTemplateSpec.spec.tolerations" -}}
  {{- end -}}
{{- end -}}
{{- toJson $value -}}
{{- end }}

{{/* The scheduling fields the chart itself puts in a component's pod spec, as a JSON object
(`fromJson` it): every component tolerates the `metax-tech.com/gpu` taint, and all but gpu-label
run only on nodes gpu-label marked. The post-renderer and the runner merge `podTemplateSpec`
(and the deprecated `tolerations`) into these, never the templates. */}}
{{- define "metax-operator.schedulingBase" -}}
{{- include "metax-operator.needs" (list "schedulingBase" . "key") -}}
{{- $base := dict "tolerations" (list (dict "key" (include "metax-operator.gpuTaint" .) "operator" "Exists" "effect" "NoSchedule")) -}}
{{- if ne .key "gpuLabel" -}}
  {{- $_ := set $base "nodeSelector" (dict (include "metax-operator.gpuNodeLabel" .) "true") -}}
{{- end -}}
{{- /* Driver pools: a pool's DaemonSet runs on the nodes the runner labelled for it, the driver's
own on those it labelled for none (src/metax_operator/chart/merge.py keeps that term in force). */ -}}
{{- if .pool -}}
  {{- $_ := set $base.nodeSelector (include "metax-operator.poolLabel" .) .pool.name -}}
{{- else if and (eq .key "driver") .root.Values.driver.pools -}}
  {{- $term := dict "matchExpressions" (list (dict "key" (include "metax-operator.poolLabel" .) "operator" "DoesNotExist")) -}}
  {{- $_ := set $base "affinity" (dict "nodeAffinity" (dict "requiredDuringSchedulingIgnoredDuringExecution" (dict "nodeSelectorTerms" (list $term)))) -}}
{{- end -}}
{{- toJson $base -}}
{{- end }}

{{/* The annotations a component DaemonSet carries for the post-renderer and the runner
(docs/chart.md): the values key, the base scheduling fields, the merge inputs, the release
revision this manifest belongs to (the runner holds its writes until Helm has applied it), and
whether its shared fields are the live DaemonSet's. Takes the component's context with "live". */}}
{{- define "metax-operator.componentAnnotations" -}}
{{- include "metax-operator.needs" (list "componentAnnotations" . "root" "key") -}}
{{- $component := (get .root.Values .key).podTemplateSpec -}}
{{- $tolerations := include "metax-operator.tolerationsList" .root | fromJsonArray -}}
{{ include "metax-operator.componentAnnotation" . }}: {{ .key }}
{{ include "metax-operator.schedulingBaseAnnotation" . }}: {{ include "metax-operator.schedulingBase" . | quote }}
{{ include "metax-operator.schedulingInputsAnnotation" . }}: {{ dict "global" (.root.Values.podTemplateSpec | default nil) "component" ($component | default nil) "tolerations" ($tolerations | default nil) | toJson | quote }}
{{ include "metax-operator.releaseRevisionAnnotation" . }}: {{ .root.Release.Revision | quote }}
{{- with .pool }}
{{ include "metax-operator.poolAnnotation" . }}: {{ .name }}
{{- end }}
{{- if .live }}
{{ include "metax-operator.sharedFieldsAnnotation" . }}: live
{{- end }}
{{- end }}

{{/* Environment every component container gets: its node and namespace (downward API) and
its log settings. Takes (dict "root" $ "key" COMPONENT), with "live" for a container whose
variables the runner sets (not an init container). */}}
{{- define "metax-operator.commonEnv" -}}
{{- include "metax-operator.needs" (list "commonEnv" . "root" "key") -}}
{{- $values := get .root.Values .key -}}
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{ include "metax-operator.valuesEnv" (dict "values" $values "group" "log" "live" .live) }}
{{- end }}

{{/* Environment variables from values fields the CR also carries (the group's in
metax-operator.valuesEnvVars; the runner sets them from the CR): a list joined with commas,
anything else as its text; the live DaemonSet's value where it has the variable. Takes
(dict "values" VALUES_MAP "group" "log"|COMPONENT), with "live" (the live DaemonSet, may be
empty) on a component's container. */}}
{{- define "metax-operator.valuesEnv" -}}
{{- include "metax-operator.needs" (list "valuesEnv" . "values" "group") -}}
{{- $values := .values -}}
{{- $live := include "metax-operator.liveEnv" . | fromJson -}}
{{- $vars := get (include "metax-operator.valuesEnvVars" . | fromJson) .group -}}
{{- if not $vars }}{{ fail (printf "valuesEnv: no environment group %q" .group) }}{{ end -}}
{{- $env := list -}}
{{- range $vars -}}
  {{- $value := $values -}}
  {{- range index . 1 }}{{ $value = get $value . }}{{ end -}}
  {{- $text := "" -}}
  {{- if hasKey $live (index . 0) }}{{ $text = get $live (index . 0) -}}
  {{- else if kindIs "slice" $value }}{{ $text = join "," $value }}{{ else if not (kindIs "invalid" $value) }}{{ $text = toString $value }}{{ end -}}
  {{- $env = append $env (dict "name" (index . 0) "value" $text) -}}
{{- end -}}
{{- toYaml $env -}}
{{- end }}

{{/* The `wait-for` init container of a component with prerequisites: it waits until the
prerequisites' pods on the same node are Ready (docs/chart.md). Takes (dict "root" $ "key" COMPONENT);
renders nothing for a component without prerequisites. */}}
{{- define "metax-operator.waitFor" -}}
{{- include "metax-operator.needs" (list "waitFor" . "root" "key") -}}
{{- $prerequisites := get (include "metax-operator.prerequisites" .root | fromJson) .key -}}
{{- if $prerequisites -}}
- name: {{ include "metax-operator.waitForContainer" . }}
  {{- include "metax-operator.toolsContainer" .root | nindent 2 }}
  command:
    - metax-operator
    - wait-for
    - --namespace
    - $(POD_NAMESPACE)
    - --node
    - $(NODE_NAME)
    {{- range $prerequisites }}
    - --component
    - {{ . }}
    {{- end }}
  env:
    {{- include "metax-operator.commonEnv" (omit . "live") | nindent 4 }}
  resources:
    requests: {cpu: 10m, memory: 32Mi}
    limits: {cpu: "1", memory: 128Mi}
  volumeMounts:
    {{- include "metax-operator.apiAccess.mount" . | nindent 4 }}
{{- end }}
{{- end }}

{{/* A container security context that meets Pod Security "restricted". */}}
{{- define "metax-operator.podSecurityRestricted" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* Pod-level fields every component pod shares: service account (its token only in the
containers that mount `apiAccess.volume`), seccomp, priority, pull secrets. */}}
{{- define "metax-operator.podCommon" -}}
{{- include "metax-operator.needs" (list "podCommon" . "root" "name") -}}
{{ include "metax-operator.podAccount" . }}
securityContext:
  seccompProfile:
    type: RuntimeDefault
{{- with .root.Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- include "metax-operator.pullSecrets" .root }}
{{- end }}

{{/* A pod's service account, its token mounted only where a container asks for it
(`apiAccess.volume`). Takes (dict "name" SERVICE_ACCOUNT ...). */}}
{{- define "metax-operator.podAccount" -}}
serviceAccountName: {{ required "podAccount takes (dict \"name\" SERVICE_ACCOUNT)" .name }}
automountServiceAccountToken: false
{{- end }}

{{/* The release's imagePullSecrets, if any (a leading newline, then the field). Takes $. */}}
{{- define "metax-operator.pullSecrets" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The init container that puts the payload copier into a driver or MXMACA pod: the tools
image's static busybox, which each payload init container then runs inside its payload image, so
that a payload image needs nothing but its files under /payload (docs/chart.md, "Payload
images"). Takes $. */}}
{{- define "metax-operator.payloadCopier" -}}
- name: {{ include "metax-operator.payloadCopierContainer" . }}
  {{- include "metax-operator.toolsContainer" . | nindent 2 }}
  command: ["cp", "/bin/busybox", "/mnt/copier/busybox"]
  terminationMessagePolicy: FallbackToLogsOnError
  resources:
    requests: {cpu: 10m, memory: 16Mi}
    limits: {cpu: 100m, memory: 32Mi}
  volumeMounts:
    - name: copier
      mountPath: /mnt/copier
{{- end }}

{{/* A payload init container: in the payload IMAGE, with the pod's copier, it checks that the
image holds a non-empty /payload and copies it into DEST. An image that does not ends it at once,
exit code metax-operator.payloadContractExit, with one line naming the image and what it lacks
as its termination message. (No `$(` in the script: Kubernetes would read it as a variable
reference of the command.) Takes (dict "root" $ "name" NAME "image" IMAGE "dest" DEST
"resources" MAP). */}}
{{- define "metax-operator.payloadContainer" -}}
{{- include "metax-operator.needs" (list "payloadContainer" . "root" "name" "image" "dest") -}}
{{- $dir := include "metax-operator.payloadDir" .root -}}
{{- $script := list
  "b=/mnt/copier/busybox"
  (printf "if [ ! -d %s ]; then m='no %s directory'" $dir $dir)
  (printf "elif [ -z \"`$b ls -A %s`\" ]; then m='an empty %s directory'" $dir $dir)
  (printf "else $b mkdir -p \"$1\"; exec $b cp -a %s/. \"$1\"; fi" $dir)
  (printf "m=\"payload image $%s has $m: a payload image holds its files under %s (docs/chart.md, Payload images)\"" (include "metax-operator.payloadImageEnv" .root) $dir)
  (printf "echo \"$m\" >/dev/termination-log; echo \"$m\" >&2; exit %s" (include "metax-operator.payloadContractExit" .root))
-}}
- name: {{ .name }}
  image: {{ .image }}
  imagePullPolicy: {{ .root.Values.imagePullPolicy }}
  command: ["/mnt/copier/busybox", "sh", "-c", {{ join "\n" $script | quote }}, "payload", {{ .dest | quote }}]
  env:
    - name: {{ include "metax-operator.payloadImageEnv" .root }}
      value: {{ .image | quote }}
  terminationMessagePolicy: FallbackToLogsOnError
  securityContext:
    {{- include "metax-operator.rootNoPrivileges" .root | nindent 4 }}
  {{- with .resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: payload
      mountPath: /mnt/payload
    - name: copier
      mountPath: /mnt/copier
      readOnly: true
{{- end }}

{{/* A container security context for a root process that writes root-owned host or volume
files without privilege: no escalation, only the file-ownership capabilities, its own files
read-only. */}}
{{- define "metax-operator.rootNoPrivileges" -}}
runAsUser: 0
privileged: false
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
  add: [CHOWN, DAC_OVERRIDE, FOWNER]
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* The container security context of a component that changes the host's kernel or services.
It says what the runtime does anyway: a privileged container runs without a seccomp filter. */}}
{{- define "metax-operator.privileged" -}}
privileged: true
seccompProfile:
  type: Unconfined
{{- end }}

{{/* A ClusterRole or Role with its binding to the component's ServiceAccount. Takes
(dict "root" $ "key" COMPONENT "name" SERVICE_ACCOUNT "roleName" NAME "clusterScoped" BOOL
"rules" LIST); the rules are written out by the caller so each file shows what it grants. */}}
{{- define "metax-operator.roleWithBinding" -}}
{{- include "metax-operator.needs" (list "roleWithBinding" . "root" "key" "name" "roleName" "rules") -}}
{{- $kind := ternary "ClusterRole" "Role" (.clusterScoped | default false) }}
apiVersion: rbac.authorization.k8s.io/v1
kind: {{ $kind }}
metadata:
  {{- include "metax-operator.metadata" (merge (dict "name" .roleName) .) | nindent 2 }}
rules:
  {{- toYaml .rules | nindent 2 }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: {{ $kind }}Binding
metadata:
  {{- include "metax-operator.metadata" (merge (dict "name" .roleName) .) | nindent 2 }}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: {{ $kind }}
  name: {{ .roleName }}
subjects:
  - kind: ServiceAccount
    name: {{ .name }}
    namespace: {{ .root.Release.Namespace }}
{{- end }}

{{/* The pod-level fields of a pod running the tools image (the runner, the hook Jobs, the helm
test): its service account, Pod Security "restricted" (the pod-level part of
metax-operator.podSecurityRestricted), the pull secrets and the scheduling of `scheduling`, the
values map holding it (`runner` or `hooks`). Takes (dict "root" $ "name" SERVICE_ACCOUNT
"scheduling" MAP). */}}
{{- define "metax-operator.toolsPod" -}}
{{- include "metax-operator.needs" (list "toolsPod" . "root" "name" "scheduling") -}}
{{ include "metax-operator.podAccount" . }}
securityContext:
  {{- pick (include "metax-operator.podSecurityRestricted" .root | fromYaml) "runAsNonRoot" "runAsUser" "runAsGroup" "seccompProfile" | toYaml | nindent 2 }}
{{- include "metax-operator.pullSecrets" .root }}
{{- include "metax-operator.podScheduling" .scheduling }}
{{- end }}

{{/* The fields every container running the tools image has: the image, its pull policy and
Pod Security "restricted". Takes $. */}}
{{- define "metax-operator.toolsContainer" -}}
image: {{ include "metax-operator.image" (dict "root" . "image" .Values.tools.image) }}
imagePullPolicy: {{ .Values.imagePullPolicy }}
securityContext:
  {{- include "metax-operator.podSecurityRestricted" . | nindent 2 }}
{{- end }}

{{/* The nodeSelector, affinity and tolerations of a tools-image pod (runner, hook Jobs, helm
test) from the values map holding them (`runner` or `hooks`); empty ones are left out. */}}
{{- define "metax-operator.podScheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The runner's pod spec (Deployment or CronJob), meeting Pod Security "restricted". With
`health` (the Deployment) it serves its health endpoint, which the kubelet probes.
Takes (dict "root" $ "key" "runner" "name" SERVICE_ACCOUNT "command" LIST ["health" true]). */}}
{{- define "metax-operator.runnerPod" -}}
{{- include "metax-operator.needs" (list "runnerPod" . "root" "name" "command") -}}
{{- $runner := .root.Values.runner -}}
{{ include "metax-operator.toolsPod" (merge (dict "scheduling" $runner) .) }}
containers:
  - name: runner
    {{- include "metax-operator.toolsContainer" .root | nindent 4 }}
    command:
      {{- toYaml .command | nindent 6 }}
    env:
      {{- include "metax-operator.valuesEnv" (dict "values" $runner "group" "log") | nindent 6 }}
      - name: POD_NAME
        valueFrom:
          fieldRef:
            fieldPath: metadata.name
    {{- with $runner.resources }}
    resources:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- if .health }}
    ports:
      - name: health
        containerPort: {{ $runner.health.port }}
        protocol: TCP
    # Restarted when its loop stops finishing iterations (runner.health.stallTimeout); not
    # Ready while the API server or its watches are out of reach (docs/runner.md).
    livenessProbe:
      httpGet:
        path: /healthz
        port: health
      periodSeconds: 10
      timeoutSeconds: 5
      failureThreshold: 3
    readinessProbe:
      httpGet:
        path: /readyz
        port: health
      periodSeconds: 10
      timeoutSeconds: 5
      failureThreshold: 3
    {{- end }}
    volumeMounts:
      - name: tmp
        mountPath: /tmp
      {{- include "metax-operator.apiAccess.mount" . | nindent 6 }}
volumes:
  - name: tmp
    emptyDir: {}
  {{- include "metax-operator.apiAccess.volume" . | nindent 2 }}
{{- end }}
