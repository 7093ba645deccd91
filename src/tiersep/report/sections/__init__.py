"""The report page's sections, one module each, every value computed and formatted once from the
collected results (tiersep.report.page puts them together into the Page the templates render).

table      the parts of a section: Table (columns grouped under headers, rows of formatted Cells)
tiers      the headline cards and the tiers table
failures   failures, refusals and records that could not be read
memory     estimate beside measurement, and how each tier ran
quality    test-set quality, museval frames, the evaluation protocols
listen     the excerpts to listen to (index.html plays them; report.md says where they are)
estimates  how each estimate was made and what it holds
facts      run facts, devices, software versions, datasets
search     a hyperparameter search: trials, each GPU budget's best, the Pareto front, packing
"""
