{{/*
Helpers of the hook Jobs (docs/hooks.md). Every hook object carries the annotations of
`metax-operator.hooks.annotations`; `hooks.annotations` from values extend and override them.
*/}}

{{/* The name of a hook's objects: `<fullname>-<hook>`. Takes (dict "root" $ "hook" NAME). */}}
{{- define "metax-operator.hooks.name" -}}
{{- include "metax-operator.needs" (list "hooks.name" . "root" "hook") -}}
{{- printf "%s-%s" (include "metax-operator.fullname" .root) .hook | trunc 63 | trimSuffix "-" -}}
{{- end }}

{{/* Whether a hook renders as a Helm hook: always for pre-delete and test hooks (as plain
resources they would run at install), else `hooks.useHelmHooks`. Takes (dict "root" $ "phases" STRING). */}}
{{- define "metax-operator.hooks.isHook" -}}
{{- include "metax-operator.needs" (list "hooks.isHook" . "root" "phases") -}}
{{- if or .root.Values.hooks.useHelmHooks (has .phases (list "pre-delete" "test")) -}}true{{- end -}}
{{- end }}

{{/* A hook object's annotations as a dict (JSON; `fromJson` it), then `hooks.annotations` on top.
As a Helm hook: Helm's hook annotations. As a plain resource (`hooks.useHelmHooks: false`): Argo
CD's sync wave `wave`, so that Argo CD runs the hooks in order before everything else (wave 0),
waiting for each wave's Jobs to complete, as Helm runs pre-upgrade hooks; and the pre-delete
cleanup is also an Argo CD PostDelete hook (Argo CD has no pre-delete hook; it runs PostDelete
ones once the application's resources are deleted). Takes (dict "root" $ "phases" STRING "weight" INT
["wave" INT] ["deletePolicy" STRING]). */}}
{{- define "metax-operator.hooks.annotations" -}}
{{- include "metax-operator.needs" (list "hooks.annotations" . "root" "phases") -}}
{{- $annotations := dict -}}
{{- if include "metax-operator.hooks.isHook" . -}}
  {{- $_ := set $annotations "helm.sh/hook" .phases -}}
  {{- $_ := set $annotations "helm.sh/hook-weight" (toString .weight) -}}
  {{- $_ := set $annotations "helm.sh/hook-delete-policy" (.deletePolicy | default "before-hook-creation,hook-succeeded") -}}
{{- else if hasKey . "wave" -}}
  {{- $_ := set $annotations "argocd.argoproj.io/sync-wave" (toString .wave) -}}
{{- end -}}
{{- if and (eq .phases "pre-delete") (not .root.Values.hooks.useHelmHooks) -}}
  {{- $_ := set $annotations "argocd.argoproj.io/hook" "PostDelete" -}}
{{- end -}}
{{- merge (dict) .root.Values.hooks.annotations $annotations | toJson -}}
{{- end }}

{{/* A hook's ServiceAccount and RBAC (weight -5): a ClusterRole for the cluster-scoped
`clusterRules`, a Role in the release namespace for `rules`; either may be empty.
`clusterAnnotations`, when given, replace the hook annotations of the ClusterRole and its binding.
Takes (dict "root" $ "hook" NAME "phases" STRING ["clusterRules" LIST] ["rules" LIST] ["key" COMPONENT_LABEL]
["wave" INT] ["clusterAnnotations" DICT]). */}}
{{- define "metax-operator.hooks.rbac" -}}
{{- include "metax-operator.needs" (list "hooks.rbac" . "root" "hook" "phases") -}}
{{- $name := include "metax-operator.hooks.name" . -}}
{{- $annotations := include "metax-operator.hooks.annotations" (merge (dict "weight" -5) (pick . "root" "phases" "wave")) | fromJson -}}
{{- $ctx := dict "root" .root "key" (.key | default "hooks") "name" $name "roleName" $name "annotations" $annotations -}}
{{- $clusterAnnotations := .clusterAnnotations | default $annotations -}}
apiVersion: v1
kind: ServiceAccount
metadata:
  {{- include "metax-operator.metadata" $ctx | nindent 2 }}
{{- with .clusterRules }}
---
{{ include "metax-operator.roleWithBinding" (merge (dict "clusterScoped" true "rules" . "annotations" $clusterAnnotations) (omit $ctx "annotations")) }}
{{- end }}
{{- with .rules }}
---
{{ include "metax-operator.roleWithBinding" (merge (dict "rules" .) $ctx) }}
{{- end }}
{{- end }}

{{/* The pod spec of a hook Job or test pod: the tools image running `metax-operator ARGS`,
Pod Security "restricted", `hooks.resources` and scheduling (`hooks.nodeSelector`, `.affinity`,
`.tolerations`), the ConfigMaps in `mounts` ({volume name:
ConfigMap name}) under /etc/metax-operator/<volume name>, and a writable /tmp.
Takes (dict "root" $ "name" SERVICE_ACCOUNT "args" LIST ["mounts" DICT] ["restartPolicy" STRING]). */}}
{{- define "metax-operator.hooks.podSpec" -}}
{{- include "metax-operator.needs" (list "hooks.podSpec" . "root" "name" "args") -}}
{{ include "metax-operator.toolsPod" (merge (dict "scheduling" .root.Values.hooks) .) }}
restartPolicy: {{ .restartPolicy | default "Never" }}
containers:
  - name: {{ index .args 0 }}
    {{- include "metax-operator.toolsContainer" .root | nindent 4 }}
    command: [metax-operator]
    args:
      {{- toYaml .args | nindent 6 }}
    resources:
      {{- toYaml .root.Values.hooks.resources | nindent 6 }}
    volumeMounts:
      - name: tmp
        mountPath: /tmp
      {{- include "metax-operator.apiAccess.mount" . | nindent 6 }}
      {{- range $volume, $_ := .mounts }}
      - name: {{ $volume }}
        mountPath: {{ include "metax-operator.hookMountRoot" . }}/{{ $volume }}
        readOnly: true
      {{- end }}
volumes:
  - name: tmp
    emptyDir:
      sizeLimit: 16Mi
  {{- range $volume, $configMap := .mounts }}
  - name: {{ $volume }}
    configMap:
      name: {{ $configMap }}
  {{- end }}
  {{- include "metax-operator.apiAccess.volume" . | nindent 2 }}
{{- end }}

{{/* A hook Job running `metax-operator ARGS`. As a Helm hook it is named `<fullname>-<hook>`
and removed `ttlSecondsAfterFinished` after it ends. As a plain resource (`hooks.useHelmHooks:
false`) its name ends in a hash of `checksum` (the inputs it reads at run time) and of its own
spec (image, arguments, settings), so new inputs or a new chart version make a new Job instead
of an update Kubernetes refuses (a Job's template is immutable), and it has no TTL: a GitOps
tool would re-create a deleted Job and run it again and again.
Takes (dict "root" $ "hook" NAME "phases" STRING "weight" INT "args" LIST ["mounts" DICT]
["checksum" STRING] ["wave" INT]). */}}
{{- define "metax-operator.hooks.job" -}}
{{- include "metax-operator.needs" (list "hooks.job" . "root" "hook" "phases" "weight" "args") -}}
{{- $name := include "metax-operator.hooks.name" . -}}
{{- $isHook := include "metax-operator.hooks.isHook" . -}}
{{- $annotations := include "metax-operator.hooks.annotations" . | fromJson -}}
{{- $spec := include "metax-operator.hooks.jobSpec" (merge (dict "name" $name "isHook" $isHook) .) -}}
{{- $jobName := ternary $name (printf "%s-%s" ($name | trunc 52 | trimSuffix "-") (print .checksum $spec | sha256sum | trunc 10)) (eq $isHook "true") -}}
{{- $skips := include "metax-operator.checkov.skips" (dict "root" .root "object" "hooks" "images" (list .root.Values.tools.image) "resources" .root.Values.hooks.resources) | fromJson -}}
{{- $ctx := dict "root" .root "key" "hooks" "name" $jobName "annotations" (merge $annotations $skips) -}}
apiVersion: batch/v1
kind: Job
metadata:
  {{- include "metax-operator.metadata" $ctx | nindent 2 }}
spec:
  {{- $spec | nindent 2 }}
{{- end }}

{{/* The spec of a hook Job (see metax-operator.hooks.job). */}}
{{- define "metax-operator.hooks.jobSpec" -}}
backoffLimit: {{ .root.Values.hooks.backoffLimit }}
activeDeadlineSeconds: {{ .root.Values.hooks.activeDeadlineSeconds }}
{{- if .isHook }}
ttlSecondsAfterFinished: {{ .root.Values.hooks.ttlSecondsAfterFinished }}
{{- end }}
template:
  metadata:
    labels:
      {{- include "metax-operator.podLabels" (dict "root" .root "key" "hooks") | nindent 6 }}
      {{ include "metax-operator.hookLabel" . }}: {{ .hook }}
  spec:
    {{- include "metax-operator.hooks.podSpec" (dict "root" .root "name" .name "args" .args "mounts" .mounts) | nindent 4 }}
{{- end }}
