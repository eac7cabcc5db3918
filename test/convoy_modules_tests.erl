%% convoy's modules call each other without cycles, so each can be read and changed
%% knowing only what it calls; and `atomics' and `counters' are called only by the
%% modules that own convoy's arrays, so each array's layout is read in one place.
-module(convoy_modules_tests).

-include_lib("eunit/include/eunit.hrl").

%% A lane's admission slots, a node's held counts and reassembly shares, counters.
-define(ARRAY_OWNERS, [convoy_held, convoy_metrics, convoy_slots]).

no_module_cycles_test() ->
    ?assertEqual([], [lists:sort(C) || C <- module_cycles()]).

arrays_called_only_by_their_owners_test() ->
    Callers = lists:usort([M || {M, _} <- module_edges("ME || [atomics, counters] : Mod")]),
    ?assertEqual([], Callers -- ?ARRAY_OWNERS).

%% Strongly connected groups of convoy's modules.
module_cycles() ->
    G = digraph:new(),
    [begin
         digraph:add_vertex(G, A),
         digraph:add_vertex(G, B),
         digraph:add_edge(G, A, B)
     end || {A, B} <- module_edges("ME || AM"), A =/= B],
    [C || C <- digraph_utils:strong_components(G), length(C) > 1].

%% Calls between modules from convoy's compiled application, as xref's `Query'.
module_edges(Query) ->
    {ok, X} = xref:start([{xref_mode, modules}]),
    try
        {ok, _} = xref:add_directory(X, filename:dirname(code:which(convoy))),
        {ok, Edges} = xref:q(X, Query),
        Edges
    after
        xref:stop(X)
    end.
