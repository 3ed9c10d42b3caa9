import bilinear_circuits as bc

run = bc.open_run("results/demo")  # what `bilinear-circuits demo` wrote
best = run.circuits().iloc[0]  # the demo's top-ranked circuit
feature = run.feature(best.layer, best.out_feature)
print(feature, feature.top_interactions(5).to_string(), sep="\n")
print("spectrum:", feature.eigenvalues[:6].round(3))
graph = run.graph("Lily was sad. She was not")
print(graph, " -> ".join(graph.top_path["description"]), sep="\n")
