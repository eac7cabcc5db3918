%% convoy's modules call each other without cycles, so each can be read and changed
%% knowing only what it calls. Two cycles predate this test and are listed as
%% known; the test fails on any other (and on either growing).
-module(convoy_modules_tests).

-include_lib("eunit/include/eunit.hrl").

-define(KNOWN_CYCLES, [[convoy, convoy_control],         % convoy_control logs convoy:info() at stop
                       [convoy_metrics, convoy_peers]]).

no_new_module_cycles_test() ->
    Cycles = [lists:sort(C) || C <- module_cycles()],
    ?assertEqual([], Cycles -- ?KNOWN_CYCLES).

%% Strongly connected groups of convoy's modules (calls between modules, from
%% the compiled application).
module_cycles() ->
    {ok, X} = xref:start([{xref_mode, modules}]),
    try
        {ok, _} = xref:add_directory(X, filename:dirname(code:which(convoy))),
        {ok, Edges} = xref:q(X, "ME || AM"),
        G = digraph:new(),
        [begin
             digraph:add_vertex(G, A),
             digraph:add_vertex(G, B),
             digraph:add_edge(G, A, B)
         end || {A, B} <- Edges, A =/= B],
        [C || C <- digraph_utils:strong_components(G), length(C) > 1]
    after
        xref:stop(X)
    end.
