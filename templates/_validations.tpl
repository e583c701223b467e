{{/*
metax-operator.validate: the cross-field rules values.schema.json cannot express (docs/validation.md).
Renders nothing; fails the render with one line per problem: `<field>: <problem>; <fix>`.
The same rules, with the same sentences, are src/metax_operator/chart/validation.py (and, for the
upgrade policy, chart/upgrade_policy.py); tests/data/bad_values.yaml runs every case through both, under
Helm 3 and Helm 4.
*/}}
{{- define "metax-operator.validate" -}}
{{- $v := .Values -}}
{{- $errors := list -}}

{{- if not $v.registry -}}
  {{- $errors = append $errors "registry: is required; set it to DOMAIN/PROJECT, e.g. --set registry=cr.example.com/metax" -}}
{{- end -}}

{{- /* Component prerequisites (seed §3.2.3). */ -}}
{{- range $component, $prerequisites := include "metax-operator.prerequisites" . | fromJson -}}
  {{- if (get $v $component).deploy -}}
    {{- range $prerequisites -}}
      {{- if not (get $v .).deploy -}}
        {{- $errors = append $errors (printf "%s.deploy: is true but its prerequisite %s.deploy is false; set %s.deploy=true or %s.deploy=false" $component . . $component) -}}
      {{- end -}}
    {{- end -}}
  {{- end -}}
{{- end -}}

{{- if and $v.driver.deploy (ne $v.driver.deployPolicy "Never") (not $v.driver.payload.version) -}}
  {{- $errors = append $errors "driver.payload.version: is required unless driver.deployPolicy is Never; set the driver version, e.g. --set driver.payload.version=2.32.0.6" -}}
{{- end -}}
{{- if and $v.driver.deploy (eq $v.driver.deployPolicy "Never") (eq $v.driver.fwUpgradePolicy "PreferCloud") -}}
  {{- $errors = append $errors "driver.fwUpgradePolicy: PreferCloud flashes the firmware the driver payload carries, and driver.deployPolicy Never deploys no payload; set driver.fwUpgradePolicy=Never, or a driver.deployPolicy that deploys the payload (PreferCloud, PreferHost or PreferNewer)" -}}
{{- end -}}

{{- /* The staged rollout's step list (the rules of chart/upgrade_policy.py the schema cannot say):
the driver's, then each pool's (its upgradeSteps and enableRollout, else the driver's), when the
driver's holds. */ -}}
{{- $policy := $v.driver.upgradePolicy -}}
{{- $stepErrors := include "metax-operator.stepProblems" (dict "steps" ($policy.upgradeSteps | default list) "enabled" $policy.enableRollout "where" "driver.upgradePolicy.upgradeSteps") | fromJsonArray -}}
{{- $errors = concat $errors $stepErrors -}}

{{- /* Driver pools: the runner on, each name and each node selector once. */ -}}
{{- if and $v.driver.pools (not $v.runner.enabled) -}}
  {{- $errors = append $errors "driver.pools: needs the runner: it puts each GPU node into its pool and rolls each pool's driver out; set runner.enabled=true, or remove driver.pools" -}}
{{- end -}}
{{- $poolNames := dict -}}
{{- $poolSelectors := dict -}}
{{- range $i, $pool := $v.driver.pools -}}
  {{- if hasKey $poolNames $pool.name -}}
    {{- $errors = append $errors (printf "driver.pools[%d].name: %s is also driver.pools[%v]'s; give each pool a name of its own" $i $pool.name (get $poolNames $pool.name)) -}}
  {{- else -}}
    {{- $_ := set $poolNames $pool.name $i -}}
  {{- end -}}
  {{- $selector := toJson $pool.nodeSelector -}}
  {{- if hasKey $poolSelectors $selector -}}
    {{- $errors = append $errors (printf "driver.pools[%d].nodeSelector: is driver.pools[%v]'s: both pools would select the same nodes; give each pool node labels that tell its nodes apart" $i (get $poolSelectors $selector)) -}}
  {{- else -}}
    {{- $_ := set $poolSelectors $selector $i -}}
  {{- end -}}
  {{- $own := $pool.upgradePolicy | default dict -}}
  {{- if and $own (not $stepErrors) -}}
    {{- $steps := hasKey $own "upgradeSteps" | ternary $own.upgradeSteps $policy.upgradeSteps | default list -}}
    {{- $enabled := hasKey $own "enableRollout" | ternary $own.enableRollout $policy.enableRollout -}}
    {{- $errors = concat $errors (include "metax-operator.stepProblems" (dict "steps" $steps "enabled" $enabled "where" (printf "driver.pools[%d].upgradePolicy.upgradeSteps" $i)) | fromJsonArray) -}}
  {{- end -}}
{{- end -}}

{{- /* vfio-manager: each GPU index once (the schema checks the format and the regex). */ -}}
{{- range $i, $entry := $v.vfioManager.vfioConfig -}}
  {{- $gpus := splitList "," ($entry.gpus | toString) -}}
  {{- $duplicates := list -}}
  {{- range $gpus -}}
    {{- $gpu := . -}}
    {{- $count := 0 -}}
    {{- range $gpus }}{{ if eq . $gpu }}{{ $count = add1 $count }}{{ end }}{{ end -}}
    {{- if and (gt $count 1) (not (has $gpu $duplicates)) -}}
      {{- $duplicates = append $duplicates $gpu -}}
    {{- end -}}
  {{- end -}}
  {{- if $duplicates -}}
    {{- $errors = append $errors (printf "vfioManager.vfioConfig[%d].gpus: lists GPU %s more than once; list each GPU index once" $i (join ", " $duplicates)) -}}
  {{- end -}}
{{- end -}}

{{- /* The exporter Service (seed table 3.14). */ -}}
{{- $service := $v.exporter.service -}}
{{- if and (not (kindIs "invalid" $service.port)) (not (has $service.type (list "NodePort" "LoadBalancer"))) -}}
  {{- $errors = append $errors (printf "exporter.service.port: is only valid with type NodePort or LoadBalancer, not %s; remove the port, or set exporter.service.type=NodePort or LoadBalancer" $service.type) -}}
{{- end -}}
{{- if and (eq $service.type "ExternalName") (not $service.externalName) -}}
  {{- $errors = append $errors "exporter.service.externalName: is required with type ExternalName; set it to the DNS name the Service points to" -}}
{{- end -}}
{{- if and (ne $service.type "ExternalName") $service.externalName -}}
  {{- $errors = append $errors (printf "exporter.service.externalName: is only valid with type ExternalName, not %s; remove it, or set exporter.service.type=ExternalName" $service.type) -}}
{{- end -}}
{{- $ports := $service.nodePortRange | toString -}}
{{- $low := splitList "-" $ports | first | atoi -}}
{{- $high := splitList "-" $ports | last | atoi -}}
{{- if or (gt $low $high) (gt $high 65535) -}}
  {{- $errors = append $errors (printf "exporter.service.nodePortRange: %s is not a range of ports; write LOW-HIGH within 1-65535, as the API server's --service-node-port-range" $ports) -}}
{{- else if and (eq $service.type "NodePort") (not (kindIs "invalid" $service.port)) (or (lt (int $service.port) $low) (gt (int $service.port) $high)) -}}
  {{- $errors = append $errors (printf "exporter.service.port: %d is outside the node port range %s; use a port in the range, leave it empty to let Kubernetes choose, or set exporter.service.nodePortRange to the cluster's --service-node-port-range" (int $service.port) $ports) -}}
{{- end -}}

{{- /* The runner's cron schedule: ranges run forwards (the schema checks the rest of its grammar). */ -}}
{{- $cronNames := dict "jan" 1 "feb" 2 "mar" 3 "apr" 4 "may" 5 "jun" 6 "jul" 7 "aug" 8 "sep" 9 "oct" 10 "nov" 11 "dec" 12 "sun" 0 "mon" 1 "tue" 2 "wed" 3 "thu" 4 "fri" 5 "sat" 6 -}}
{{- range $part := $v.runner.schedule | default "" | replace "," " " | splitList " " -}}
  {{- $range := splitList "/" $part | first | splitList "-" -}}
  {{- if eq (len $range) 2 -}}
    {{- $bounds := list -}}
    {{- range $range -}}
      {{- $bounds = append $bounds (hasKey $cronNames (lower .) | ternary (get $cronNames (lower .)) (atoi .)) -}}
    {{- end -}}
    {{- if gt (index $bounds 0) (index $bounds 1) -}}
      {{- $errors = append $errors (printf "runner.schedule: the range %s-%s runs backwards; write the smaller value first: %s-%s" (index $range 0) (index $range 1) (index $range 1) (index $range 0)) -}}
    {{- end -}}
  {{- end -}}
{{- end -}}

{{- /* Image repositories (registry/name): the schema checks each part, not their length together
(src/metax_operator/chart/images.py). */ -}}
{{- $sites := list (list "tools.image" $v.tools.image) (list "driver.payload" $v.driver.payload) -}}
{{- range $component := include "metax-operator.components" . | fromJsonArray -}}
  {{- $sites = append $sites (list (printf "%s.image" (index $component 0)) (get $v (index $component 0)).image) -}}
{{- end -}}
{{- range $i, $entry := $v.maca.payload.images -}}
  {{- $sites = append $sites (list (printf "maca.payload.images[%d]" $i) (dict "registry" $v.maca.payload.registry "name" (regexReplaceAll "[:@].*$" (toString $entry) ""))) -}}
{{- end -}}
{{- range $site := $sites -}}
  {{- $image := index $site 1 -}}
  {{- if $image.name -}}
    {{- $length := add (len ($image.registry | default $v.registry | default "")) 1 (len $image.name) -}}
    {{- if gt $length 255 -}}
      {{- $errors = append $errors (printf "%s: the image repository (registry/name) is %d characters long, more than 255; shorten the registry or the image name" (index $site 0) $length) -}}
    {{- end -}}
  {{- end -}}
{{- end -}}

{{- /* The deprecated `tolerations` from `--set-file tolerations=FILE`: the schema sees only a string. */ -}}
{{- if kindIs "string" $v.tolerations -}}
  {{- $known := list "effect" "key" "operator" "tolerationSeconds" "value" -}}
  {{- range $i, $toleration := include "metax-operator.tolerationsList" . | fromJsonArray -}}
    {{- range $key := keys $toleration | sortAlpha -}}
      {{- if not (has $key $known) -}}
        {{- $errors = append $errors (printf "tolerations[%d].%s: is not a known option; remove it (known: %s)" $i $key (join ", " $known)) -}}
      {{- end -}}
    {{- end -}}
    {{- if and (hasKey $toleration "operator") (not (has $toleration.operator (list "Exists" "Equal"))) -}}
      {{- $errors = append $errors (printf "tolerations[%d].operator: '%v' is not one of Exists, Equal; use one of them" $i $toleration.operator) -}}
    {{- end -}}
    {{- if and (hasKey $toleration "effect") (not (has $toleration.effect (list "NoSchedule" "PreferNoSchedule" "NoExecute"))) -}}
      {{- $errors = append $errors (printf "tolerations[%d].effect: '%v' is not one of NoSchedule, PreferNoSchedule, NoExecute; use one of them" $i $toleration.effect) -}}
    {{- end -}}
  {{- end -}}
{{- end -}}

{{- if $errors -}}
  {{- fail (printf "invalid values:\n%s" (join "\n" $errors)) -}}
{{- end -}}
{{- end -}}

{{/* The rules between an upgrade policy's steps, as a JSON list of problems.
Takes (dict "steps" STEPS "enabled" ENABLE_ROLLOUT "where" FIELD_PATH). */}}
{{- define "metax-operator.stepProblems" -}}
{{- $steps := .steps -}}
{{- $enabled := .enabled -}}
{{- $where := .where -}}
{{- $errors := list -}}
{{- if and $enabled (not $steps) -}}
  {{- $errors = append $errors (printf "%s: is empty while enableRollout is true; add at least one step, the last with replicas: \"100%%\"" $where) -}}
{{- end -}}
{{- $previous := "" -}}
{{- range $i, $step := $steps -}}
  {{- $replicas := $step.replicas | toString -}}
  {{- if and $previous (eq (hasSuffix "%" $replicas) (hasSuffix "%" $previous)) (lt (trimSuffix "%" $replicas | atoi) (trimSuffix "%" $previous | atoi)) -}}
    {{- $errors = append $errors (printf "%s[%d].replicas: %s is below the previous step's %s; targets count upgraded pods in total, so make each step's replicas at least the previous one's" $where $i $replicas $previous) -}}
  {{- end -}}
  {{- $previous = $replicas -}}
  {{- if and (eq (add1 $i) (len $steps)) (hasSuffix "%" $replicas) (ne $replicas "100%") -}}
    {{- $errors = append $errors (printf "%s[%d].replicas: the last step reaches only %s; set the last step's replicas to \"100%%\" so every node is upgraded" $where $i $replicas) -}}
  {{- end -}}
  {{- if and (hasKey $step "pause") (hasKey $step "pauseDuration") -}}
    {{- $errors = append $errors (printf "%s[%d].pause: is given together with pauseDuration; keep only pauseDuration (empty or {} waits for the admin; milliseconds continue)" $where $i) -}}
  {{- end -}}
{{- end -}}

{{- toJson $errors -}}
{{- end }}
