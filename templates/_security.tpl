{{/*
Security helpers (docs/security.md): the ServiceAccount token only where a container calls the
API, and the scanner exceptions, each with its reason, written once in one table.
*/}}

{{/* The ServiceAccount token, CA and namespace as a projected volume: what the kubelet would mount
into every container, given only to the containers that call the API (`apiAccess.mount`). Pods
set `automountServiceAccountToken: false`. The token expires after an hour and the kubelet
renews it; the kubernetes Python client rereads it. */}}
{{- define "metax-operator.apiAccess.volume" -}}
- name: kube-api-access
  projected:
    defaultMode: 0444
    sources:
      - serviceAccountToken:
          path: token
          expirationSeconds: 3600
      - configMap:
          name: kube-root-ca.crt
          items:
            - key: ca.crt
              path: ca.crt
      - downwardAPI:
          items:
            - path: namespace
              fieldRef:
                fieldPath: metadata.namespace
{{- end }}

{{/* The mount of `apiAccess.volume` where in-cluster clients look for it. */}}
{{- define "metax-operator.apiAccess.mount" -}}
- name: kube-api-access
  mountPath: /var/run/secrets/kubernetes.io/serviceaccount
  readOnly: true
{{- end }}

{{/* The Checkov checks each object cannot pass, and why: the one table behind every
`checkov.io/skipN` annotation and docs/security.md (tests/templates/test_checkov.py checks they agree).
`pods` applies to every object that runs pods, the other keys to one object each (the component
values key, or `runner`, `hooks`, `tests`, `runnerEvents`). An entry with `when` is skipped only
while that condition holds (see `checkov.skips`); the others always. A reason may not contain `=`
(Checkov splits the annotation there). */}}
{{- define "metax-operator.checkov.table" -}}
reasons:
  noProbe: &noProbe the MetaX image serves no port and documents no command to probe; the kubelet restarts it when its process exits
pods:
  CKV_K8S_15:
    when: pullPolicyNotAlways
    reason: imagePullPolicy is not Always so that a restarting pod does not need the registry (an outage must not keep GPU nodes down); pin image digests to fix what runs
  CKV_K8S_43:
    when: imageByTag
    reason: an image is referenced by tag; set its digest in the values to pull it by digest
  CKV2_K8S_6:
    when: noNetworkPolicy
    reason: NetworkPolicies are opt-in; set networkPolicy.enabled to render them
gpuLabel:
  CKV_K8S_8: {reason: *noProbe}
  CKV_K8S_9: {reason: *noProbe}
runtime:
  CKV_K8S_8: {reason: *noProbe}
  CKV_K8S_9: {reason: *noProbe}
  CKV_K8S_16: &runtimePrivileged
    reason: privileged to install the runtime hook into the host's containerd or Docker configuration and have the host runtime reload it
  CKV_K8S_20: *runtimePrivileged
  CKV_K8S_22: *runtimePrivileged
  CKV_K8S_23: *runtimePrivileged
  CKV_K8S_28: *runtimePrivileged
  CKV_K8S_37: *runtimePrivileged
  CKV_K8S_40: *runtimePrivileged
  CKV_K8S_17:
    reason: shares the host PID namespace to have the host's containerd or dockerd reload its configuration
driver:
  CKV_K8S_8:
    reason: no liveness probe because a restart during a module load or firmware flash can leave the GPU unusable; its readiness probe gates the staged rollout
  CKV_K8S_11:
    when: noCpuLimit
    reason: no CPU limit because it installs the driver while the node's GPUs are out of service and throttling would only make that longer
  CKV_K8S_16: &driverPrivileged
    reason: privileged to load kernel modules, flash GPU firmware and create device nodes on the host
  CKV_K8S_20: *driverPrivileged
  CKV_K8S_22: *driverPrivileged
  CKV_K8S_23: *driverPrivileged
  CKV_K8S_28: *driverPrivileged
  CKV_K8S_37: *driverPrivileged
  CKV_K8S_40: *driverPrivileged
  CKV_K8S_25: &payloadCopy
    reason: root with only CHOWN, DAC_OVERRIDE and FOWNER to copy the payload image's files keeping their owners and modes
maca:
  CKV_K8S_8:
    reason: the image documents no health command; its readiness probe (the SDK installed) is the only state it shows
  CKV_K8S_11:
    when: noCpuLimit
    reason: no CPU limit because it installs the MXMACA SDK that the node's GPU workloads wait for and throttling would only make that longer
  CKV_K8S_23: &macaRoot
    reason: root with only CHOWN, DAC_OVERRIDE and FOWNER to write the MXMACA SDK into the root-owned host directory /opt/metax/maca keeping the payload's owners and modes
  CKV_K8S_25: *macaRoot
  CKV_K8S_40: *macaRoot
gpuDevice:
  CKV_K8S_8: {reason: *noProbe}
  CKV_K8S_9: {reason: *noProbe}
  CKV_K8S_23: &deviceRoot
    reason: root without any capability to serve its socket in the kubelet's root-owned /var/lib/kubelet/device-plugins directory
  CKV_K8S_40: *deviceRoot
exporter:
  CKV_K8S_23: &exporterRoot
    reason: root without any capability to read the GPU driver's sysfs attributes and device nodes, not documented as readable by other users
  CKV_K8S_40: *exporterRoot
vfioManager:
  CKV_K8S_8: {reason: *noProbe}
  CKV_K8S_9: {reason: *noProbe}
  CKV_K8S_16: &vfioPrivileged
    reason: privileged to load vfio-pci and rebind PCI functions to it through sysfs
  CKV_K8S_20: *vfioPrivileged
  CKV_K8S_22: *vfioPrivileged
  CKV_K8S_23: *vfioPrivileged
  CKV_K8S_28: *vfioPrivileged
  CKV_K8S_37: *vfioPrivileged
  CKV_K8S_40: *vfioPrivileged
tests:
  CKV_K8S_8: &testPod
    reason: a helm test pod runs one check to completion; there is nothing to probe
  CKV_K8S_9: *testPod
runnerEvents:
  CKV_K8S_21:
    reason: Events about the cluster-scoped ClusterOperator live in namespace default where kubectl describe finds them; this grants only creating and patching Events there
{{- end }}

{{/* The `checkov.io/skipN: CHECK=REASON` annotations of one object, as a JSON object (`fromJson`
it). Takes (dict "root" $ "object" TABLE_KEY ["images" LIST] ["resources" DICT]): `images`, the
image values the object's pods run (each `{registry, name, tag, digest}`, or a payload reference
string), marks an object that runs pods; `resources` are its containers' resources. The
conditions of the table:
  pullPolicyNotAlways  `imagePullPolicy` is not Always
  imageByTag           one of `images` has no digest
  noNetworkPolicy      `networkPolicy.enabled` is false
  noCpuLimit           `resources` has no CPU limit */}}
{{- define "metax-operator.checkov.skips" -}}
{{- include "metax-operator.needs" (list "checkov.skips" . "root" "object") -}}
{{- $table := include "metax-operator.checkov.table" . | fromYaml -}}
{{- $entries := dict -}}
{{- if .images -}}
  {{- $entries = merge $entries $table.pods -}}
{{- end -}}
{{- $entries = merge $entries (get $table .object | default dict) -}}
{{- $byTag := false -}}
{{- range .images -}}
  {{- if kindIs "string" . -}}
    {{- if not (contains "@" .) }}{{ $byTag = true }}{{ end -}}
  {{- else if not .digest -}}
    {{- $byTag = true -}}
  {{- end -}}
{{- end -}}
{{- $holds := dict
  "pullPolicyNotAlways" (ne .root.Values.imagePullPolicy "Always")
  "imageByTag" $byTag
  "noNetworkPolicy" (not .root.Values.networkPolicy.enabled)
  "noCpuLimit" (not (dig "limits" "cpu" "" (.resources | default dict))) -}}
{{- $annotations := dict -}}
{{- $n := 0 -}}
{{- range $check := keys $entries | sortAlpha -}}
  {{- $entry := get $entries $check -}}
  {{- if or (not $entry.when) (get $holds $entry.when) -}}
    {{- $n = add1 $n -}}
    {{- $_ := set $annotations (printf "checkov.io/skip%d" $n) (printf "%s=%s" $check $entry.reason) -}}
  {{- end -}}
{{- end -}}
{{- toJson $annotations -}}
{{- end }}
